"""What torch.compile's on-disk caches must key a graph on, of tpcomm.
Inductor's FX graph cache and AOTAutograd's key a graph by its code, where a
call of a tpcomm op reads the same whatever that op's schema, its fake
shapes or the compile pass that wrote it: without more in the key, a graph
compiled against one tpcomm is replayed under another (a call the op no
longer takes fails with "expected at most 5 argument(s)"). fingerprint()
covers tpcomm's version, the source of every module that decides what the
pass writes into a graph or what the compiler sees of tpcomm's ops, and the
schema of every registered tpcomm op (both namespaces, the C++ binding's
included); tpcomm.compile_backend puts it into the key while it compiles
(cache_key_tag) and TpcommPass.uuid holds it."""
import functools
import hashlib
import os

from . import _version, ops

# The modules whose code shapes a compiled graph: the backend, the pass and its fusion,
# the patterns' numbering, the inductor pass, the ops' definitions, fake
# shapes and autograd, and this key itself.
GRAPH_SOURCES = ("compile_pass.py", "graph_pass.py", "fusion.py", "norm_patterns.py", "inductor_pass.py", "ops.py",
                 "_fake.py", "_shapes.py", "_autograd.py", "_cache_key.py", "aten_norms.py", "unfused_report.py",
                 "fp8.py", "norm_fp8.py", "fusion_fp8.py")


@functools.cache
def _sources_digest():
    """The digest of GRAPH_SOURCES as this process imported them."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in GRAPH_SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def op_schemas():
    """The schema of every op registered in tpcomm's namespaces now, sorted."""
    return sorted(str(op._schema) for op in ops.registered())


def fingerprint():
    """A digest of tpcomm's version, GRAPH_SOURCES and op_schemas()."""
    digest = hashlib.sha256()
    for part in (_version.__version__, _sources_digest(), *op_schemas()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]

"""Everything tpcomm.integrations.vllm relies on in vLLM, as data, and a
reader that checks it against vLLM's sources without importing vLLM (parsed
with `ast`: importing vLLM needs its CUDA build). The tests run it on the
pinned release's wheel; `gaps(reader)` works on any copy of the sources, an
installed one included (`installed_reader()`).

CONTRACT maps a file of the vllm package to its names: "Class.method",
"function" or "NAME" (a module-level assignment), each with what must hold:

    params      the leading parameters, by name and in order (self/cls left out)
    assigns     attributes the function sets on self
    calls       callee (as written) -> the keywords every such call may use
                (None: any); the callee must be called at least once
    reads       attribute chains the function reads (as written)
    strings     string constants the function contains
    value       the constant a module-level name is assigned
    keys        string keys of the dict literal a module-level name is assigned
"""
import ast
import importlib.util
import os

PINNED = "vllm==0.33.0"

# TpcommCudaCommunicator.__init__ takes exactly these, in this order, and
# passes them all on to CudaCommunicator.__init__ by keyword.
COMMUNICATOR_INIT = ("cpu_group", "device", "device_group", "unique_name", "global_ranks", "global_world_size",
                     "tcp_store_group", "use_all2all")

_COMMUNICATORS = "vllm/distributed/device_communicators/"

CONTRACT = {
    # The plugin loader: the entry point group, VLLM_PLUGINS as the filter,
    # and vLLM's own CUDA detection, which register() asks.
    "vllm/plugins/__init__.py": {
        "PLATFORM_PLUGINS_GROUP": {"value": "vllm.platform_plugins"},
        "load_plugins_by_group": {"params": ("group",), "reads": ("envs.VLLM_PLUGINS",)},
    },
    "vllm/platforms/__init__.py": {
        "cuda_platform_plugin": {"params": ()},
        "resolve_current_platform_cls_qualname": {"calls": {"load_plugins_by_group": None}},
    },
    "vllm/envs.py": {
        "environment_variables": {"keys": ("VLLM_PLUGINS", "VLLM_BATCH_INVARIANT")},
    },
    # The platform subclassed, and the hook it overrides.
    "vllm/platforms/cuda.py": {
        "CudaPlatform": {},
        "CudaPlatformBase.get_device_communicator_cls": {"params": ()},
    },
    # The communicator subclassed: its constructor, the ops overridden, the
    # attributes read, and vLLM's own test for a TP group.
    _COMMUNICATORS + "cuda_communicator.py": {
        "CudaCommunicator.__init__": {"params": COMMUNICATOR_INIT, "assigns": ("use_custom_allreduce",),
                                      "strings": ("tp",)},
        "CudaCommunicator.all_reduce": {"params": ("input_",)},
        "CudaCommunicator.all_gather": {"params": ("input_", "dim")},
        "CudaCommunicator.reduce_scatter": {"params": ("input_", "dim"), "calls": {"input_.movedim": None}},
        "CudaCommunicator.destroy": {"params": ()},
    },
    _COMMUNICATORS + "base_device_communicator.py": {
        "DeviceCommunicatorBase.__init__": {"params": COMMUNICATOR_INIT[:6],
                                            "assigns": ("device", "cpu_group", "device_group", "unique_name",
                                                        "world_size")},
    },
    # Where vLLM builds the communicator (from the platform, by keyword) and
    # calls the overridden ops; TP groups are named "tp".
    "vllm/distributed/parallel_state.py": {
        "GroupCoordinator.__init__": {"calls": {"device_comm_cls": COMMUNICATOR_INIT},
                                      "reads": ("current_platform.get_device_communicator_cls",)},
        "GroupCoordinator._all_reduce_out_place": {"calls": {"self.device_communicator.all_reduce": None}},
        "GroupCoordinator._all_gather_out_place": {"calls": {"self.device_communicator.all_gather": None}},
        "GroupCoordinator._reduce_scatter_out_place": {"calls": {"self.device_communicator.reduce_scatter": None}},
        "GroupCoordinator.destroy": {"calls": {"self.device_communicator.destroy": None}},
        "initialize_model_parallel": {"strings": ("tp",)},
    },
}


def gaps(read, contract=None):
    """What `contract` (default: CONTRACT) asks for and the sources lack, as
    sentences (empty: every item holds). read(path) returns a file's source."""
    out = []
    for path, items in (CONTRACT if contract is None else contract).items():
        try:
            module = _Module(read(path))
        except (OSError, KeyError, SyntaxError) as e:
            out.append(f"{path}: cannot be read ({type(e).__name__}: {e})")
            continue
        for name, needs in items.items():
            out += [f"{path}: {name}: {gap}" for gap in module.gaps(name, needs)]
    return out


def installed_reader():
    """read(path) over the vllm package this Python would import (not
    importing it); FileNotFoundError when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm is not installed")
    root = os.path.dirname(list(spec.submodule_search_locations)[0])

    def read(path):
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return f.read()
    return read


class _Module:
    def __init__(self, source):
        self.tree = ast.parse(source)
        self.defs, self.assigned = {}, {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.defs[node.name] = node
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.defs[f"{node.name}.{item.name}"] = item
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.assigned[t.id] = node.value

    def gaps(self, name, needs):
        if name in self.assigned and name not in self.defs:
            return self._assignment_gaps(self.assigned[name], needs)
        node = self.defs.get(name)
        if node is None:
            return ["not defined"]
        out = []
        if "params" in needs:
            a = node.args
            have = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            if have[:len(needs["params"])] != list(needs["params"]):
                out.append(f"takes {have}, expected to start with {list(needs['params'])}")
        walked = list(ast.walk(node))
        if "assigns" in needs:
            set_on_self = {t.attr for n in walked if isinstance(n, (ast.Assign, ast.AnnAssign))
                           for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            out += [f"does not set self.{attr}" for attr in needs["assigns"] if attr not in set_on_self]
        for callee, allowed in needs.get("calls", {}).items():
            calls = [n for n in walked if isinstance(n, ast.Call) and ast.unparse(n.func) == callee]
            if not calls:
                out.append(f"does not call {callee}")
            for call in calls if allowed is not None else ():
                extra = sorted(k.arg for k in call.keywords if k.arg not in allowed)
                if extra or any(k.arg is None for k in call.keywords):
                    out.append(f"calls {callee} with keywords {extra or ['**']} outside {list(allowed)}")
        if "reads" in needs:
            chains = {ast.unparse(n) for n in walked if isinstance(n, ast.Attribute)}
            out += [f"does not read {chain}" for chain in needs["reads"] if chain not in chains]
        if "strings" in needs:
            constants = {n.value for n in walked if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            out += [f"has no string {s!r}" for s in needs["strings"] if s not in constants]
        return out

    @staticmethod
    def _assignment_gaps(value, needs):
        out = []
        if "value" in needs and not (isinstance(value, ast.Constant) and value.value == needs["value"]):
            out.append(f"is {ast.unparse(value)}, expected {needs['value']!r}")
        if "keys" in needs:
            keys = {k.value for k in getattr(value, "keys", []) if isinstance(k, ast.Constant)}
            if not isinstance(value, ast.Dict):
                out.append(f"is not a dict literal: {ast.unparse(value)[:80]}")
            out += [f"has no key {k!r}" for k in needs["keys"] if k not in keys]
        return out

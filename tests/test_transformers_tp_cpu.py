"""A client nobody here wrote: Hugging Face transformers' Llama with its own
tensor-parallel plan (tp_plan="auto"), tiny and random, on 2 gloo ranks.
Its row-parallel layers sum their outputs with dist.all_reduce(output,
group=...); with tpcomm:
  eager, inside tpcomm.install(group): the same greedy tokens and
    bit-identical logits (the Communicator's fallback is gloo's all_reduce
    on the CPU), every row-parallel sum counted in stats();
  compiled with tpcomm.compile_backend: each all_reduce rewritten and fused
    with the residual add and the RMSNorm after it (4 per forward for 2
    layers), the same tokens, and logits within fp32's default tolerance of
    torch.testing (rtol 1.3e-6, atol 1e-5): the fused op sums the squares of
    the norm in its own order.
The model loads from a directory (save_pretrained of a random LlamaConfig
model): nothing is downloaded."""
import os

import pytest
import torch

from multiproc import run_ranks
from tpcomm.graph_pass import COUNTED

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

LAYERS = 2
PROMPT = [[3, 17, 5, 42, 9, 11]]
STEPS = 3
MODEL_DIR_ENV = "TPCOMM_TEST_LLAMA_DIR"


def _greedy(forward, steps=STEPS):
    """Greedy decoding without a KV cache: (tokens, the last position's
    logits at every step)."""
    ids = torch.tensor(PROMPT)
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            last = forward(ids)[:, -1]
            logits.append(last)
            token = last.argmax(-1, keepdim=True)
            tokens.append(token.item())
            ids = torch.cat([ids, token], dim=1)
    return tokens, torch.stack(logits)


def _calls(comm):
    return {f"{op}/{backend}": s["calls"] for (op, backend), s in comm.stats().items()}


def _body(rank, world_size):
    import tpcomm
    from transformers import DistributedConfig, LlamaForCausalLM

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    model = LlamaForCausalLM.from_pretrained(os.environ[MODEL_DIR_ENV], dtype=torch.float32,
                                             distributed_config=DistributedConfig(tp_plan="auto")).eval()
    group = model._device_mesh["tp"].get_group()
    comm = tpcomm.Communicator(group, device="cpu")

    def forward(ids):
        return model(ids, use_cache=False).logits

    tokens, logits = _greedy(forward)
    assert _calls(comm) == {}

    with tpcomm.install(group):
        installed_tokens, installed_logits = _greedy(forward)
    assert installed_tokens == tokens and torch.equal(installed_logits, logits)
    # the row-parallel all-reduces (dist.all_reduce), and DTensor's: the embedding's all-reduce and the LM
    # head's all-gather (redistribute)
    assert _calls(comm) == {"all_reduce/gloo": (2 * LAYERS + 1) * STEPS, "all_gather/gloo": STEPS}, _calls(comm)

    torch._dynamo.reset()
    backend = tpcomm.compile_backend("aot_eager")
    compiled = torch.compile(model, backend=backend)
    compiled_tokens, compiled_logits = _greedy(lambda ids: compiled(ids, use_cache=False).logits)
    assert compiled_tokens == tokens
    torch.testing.assert_close(compiled_logits, logits, rtol=1.3e-6, atol=1e-5)
    graphs = backend.counts["all_gather"]  # the LM head's, one a graph
    assert graphs >= 1 and backend.counts == dict(dict.fromkeys(COUNTED, 0), all_reduce=(2 * LAYERS + 1) * graphs,
                                                  all_gather=graphs, all_reduce_add_rms_norm=2 * LAYERS * graphs)
    fused = _calls(comm).get("all_reduce_add_rms_norm/unfused", 0)
    assert fused == 2 * LAYERS * STEPS, _calls(comm)  # every compiled step: every all_reduce, fused
    comm.close()


def test_llama_tp_plan_same_tokens_with_tpcomm(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    run_ranks(2, _body, env={MODEL_DIR_ENV: str(tmp_path)}, timeout=240)

"""A stand-in for the parts of vLLM (the release pinned in
tpcomm.integrations.vllm_contract) that tpcomm.integrations.vllm uses: the
same module paths, names, signatures and behaviour of those parts, on CPU
tensors and gloo groups. tests/test_vllm_contract.py checks it against the
same contract as the real release; tests/test_vllm_plugin_cpu.py runs the
plugin on it. Put tests/data/vllm_stand_in on sys.path to import it as
`vllm`."""
STAND_IN = True

"""tpcomm inside other software, each in its own module, imported only when
asked for (none of them is imported by `import tpcomm`):

    tpcomm.integrations.vllm    a vLLM platform plugin whose device communicator
                                sends vLLM's tensor-parallel collectives through tpcomm
"""

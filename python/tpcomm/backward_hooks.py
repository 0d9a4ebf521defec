"""Module-level backward hooks out of torch.compile's way where grad is off:

    tpcomm.skip_backward_hooks_without_grad(model)    # once, after loading
    compiled = torch.compile(model, backend=tpcomm.compile_backend())
    with torch.no_grad():                              # or torch.inference_mode()
        compiled(input_ids)

A module with a full backward hook or backward pre-hook
(register_full_backward_hook: transformers 5.3 to 5.21 put one on every
q_norm / k_norm their TP plans mark "replicated_with_grad_allreduce") makes
Dynamo break the graph at each call of that module ("Module-level backwards
hooks require compiled autograd"), so an all-reduce and the add + RMSNorm
after it land in different graphs and nothing fuses.

Such a hook can only fire through autograd: nn.Module's call sets it up on
tensors that require grad while grad is enabled (torch.utils.hooks.
BackwardHook does nothing otherwise, and the legacy non-full hooks attach to
a grad_fn, which no output has then). So while torch.is_grad_enabled() is
False, a call without the hooks computes and does exactly what a call with
them does. This function makes each hooked module give nn.Module's call no
backward hooks while grad is disabled; with grad enabled it gives the hooks
it holds, which stay registered (module._backward_hooks is not touched), so
training and any forward under grad run them as before. Dynamo reads
torch.is_grad_enabled() as a constant and guards on the grad mode, so a
graph compiled without grad is never reused with grad, and the one compiled
with grad breaks at the hooks as it always did.

Only the hooks a module holds when this runs (register hooks first, then
call it) and the module's own: global hooks
(register_module_full_backward_hook) are not changed.
"""
import types

import torch


def _hooks_without_grad(module):
    """nn.Module._get_backward_hooks of `module`, or none while grad is off."""
    if torch.is_grad_enabled():
        return type(module)._get_backward_hooks(module)
    return [], []


def _pre_hooks_without_grad(module):
    """nn.Module._get_backward_pre_hooks of `module`, or none while grad is off."""
    if torch.is_grad_enabled():
        return type(module)._get_backward_pre_hooks(module)
    return []


# nn.Module's call reads a module's backward hooks through these two methods (torch/nn/modules/module.py,
# _call_impl); each hooked module gets its own, bound to it (copy.deepcopy binds the copy's to the copy)
_GETTERS = {"_get_backward_hooks": _hooks_without_grad, "_get_backward_pre_hooks": _pre_hooks_without_grad}


def skip_backward_hooks_without_grad(model: torch.nn.Module) -> int:
    """Makes every module of `model` (itself included) that holds a full
    backward hook or backward pre-hook skip them while grad is disabled (see
    the module's doc). Idempotent; returns how many modules hold such hooks."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tpcomm.skip_backward_hooks_without_grad takes a torch.nn.Module, got {type(model).__name__}")
    missing = [name for name in _GETTERS if not callable(getattr(torch.nn.Module, name, None))]
    if missing:
        raise RuntimeError(f"tpcomm.skip_backward_hooks_without_grad: this torch's nn.Module has no {missing}")
    hooked = 0
    for module in model.modules():
        if not (module._backward_hooks or module._backward_pre_hooks):
            continue
        hooked += 1
        for name, getter in _GETTERS.items():
            if getattr(module.__dict__.get(name), "__func__", None) is not getter:
                setattr(module, name, types.MethodType(getter, module))
    return hooked

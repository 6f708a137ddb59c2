"""Hugging Face transformers integration: one-line patching of transformers models with the kernels.

    import liger_torch
    liger_torch.apply_liger_kernel_to_llama()            # models built afterwards use the kernels
    model = AutoModelForCausalLM.from_pretrained(...)
    liger_torch.apply_liger_kernel(model)                # or patch a built (or PEFT-wrapped) model in place
    liger_torch.revert_liger_kernel()                    # undo module-level patching

In training with labels the patched causal-LM forward computes the loss with the fused linear cross-entropy
kernel and returns ``logits=None``; see :mod:`liger_torch.transformers.monkey_patch` and ``_causal_lm``.
"""

from .monkey_patch import (FAMILIES, AutoLigerKernelForCausalLM, apply_liger_kernel, apply_liger_kernel_to_gemma,
                           apply_liger_kernel_to_gemma2, apply_liger_kernel_to_gemma3,
                           apply_liger_kernel_to_gemma3_text, apply_liger_kernel_to_granite,
                           apply_liger_kernel_to_llama, apply_liger_kernel_to_mistral,
                           apply_liger_kernel_to_mixtral, apply_liger_kernel_to_olmo2, apply_liger_kernel_to_phi3,
                           apply_liger_kernel_to_qwen2, apply_liger_kernel_to_qwen3,
                           apply_liger_kernel_to_qwen3_moe, liger_kernel_patched, patched_families,
                           revert_liger_kernel)

__all__ = ["FAMILIES", "AutoLigerKernelForCausalLM", "apply_liger_kernel", "liger_kernel_patched",
           "patched_families", "revert_liger_kernel", "apply_liger_kernel_to_gemma", "apply_liger_kernel_to_gemma2",
           "apply_liger_kernel_to_gemma3", "apply_liger_kernel_to_gemma3_text", "apply_liger_kernel_to_granite",
           "apply_liger_kernel_to_llama", "apply_liger_kernel_to_mistral", "apply_liger_kernel_to_mixtral",
           "apply_liger_kernel_to_olmo2", "apply_liger_kernel_to_phi3", "apply_liger_kernel_to_qwen2",
           "apply_liger_kernel_to_qwen3", "apply_liger_kernel_to_qwen3_moe"]

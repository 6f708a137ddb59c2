"""liger_jax.models: Flax NNX models on the liger_jax kernels, with Hugging Face weight conversion.

``from liger_jax.models import from_hf``; ``from_hf(hf_model, use_kernels=True)`` gives a
:class:`LlamaForCausalLM` (llama, mistral, qwen2, qwen3, gemma) with the same weights; ``to_hf`` goes back.
Training: :mod:`liger_jax.models.train` (``Trainer``, ``make_train_step``: optax under jit, data-parallel / FSDP).
"""

from .hf import config_from_hf, config_to_hf, from_hf, state_dict_from_flax, to_hf
from .llama import Kernels, LlamaConfig, LlamaForCausalLM, inv_frequencies, shift_labels, tap_names

__all__ = ["Kernels", "LlamaConfig", "LlamaForCausalLM", "from_hf", "to_hf", "config_from_hf", "config_to_hf",
           "state_dict_from_flax", "inv_frequencies", "shift_labels", "tap_names"]

"""Unmodified Hugging Face ``transformers`` models under tessera's layouts.

``tessera.initialize`` calls :func:`prepare` on a ``transformers`` model: with more than one
tensor rank the model's policy rewrites it in place (GPT-2; LLaMA and the models that share its
layout; Mixtral, whose experts it also spreads over the expert axis; BERT; ViT). A model without a policy fails there, naming the layouts that work (data
parallel, ZeRO, Gemini); :func:`register_policy` adds one. ``transformers`` is an optional extra
(``pip install 'tessera[hf]'``); nothing here imports it.
"""

from tessera.hf.apply import is_hf_model, policy_for, prepare, registered
from tessera.hf.policy import Policy, register_policy
from tessera.hf.weights import PretrainedWeights, from_pretrained, load_pretrained, save_pretrained

__all__ = [
    "Policy",
    "PretrainedWeights",
    "from_pretrained",
    "is_hf_model",
    "load_pretrained",
    "policy_for",
    "prepare",
    "register_policy",
    "registered",
    "save_pretrained",
]

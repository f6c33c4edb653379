"""Generation for tessera's GPT and Hugging Face causal LMs under tensor (1d) and pipeline
parallelism: a paged KV cache, continuous batching, sampling and int8 weights (docs/serving.md).

    runner = prepare_model(model, ctx, init)          # this rank's part, laid out and filled
    engine = InferenceEngine(runner, ctx, CacheOptions(num_blocks=256, block_size=16))
    results = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
"""

from tessera.inference.engine import CacheOptions, InferenceEngine, Result
from tessera.inference.models import prepare_model
from tessera.inference.params import SamplingParams
from tessera.inference.quantize import QuantReport, quantize_int8
from tessera.inference.text import ByteTokenizer, TextStream

__all__ = [
    "ByteTokenizer",
    "CacheOptions",
    "InferenceEngine",
    "QuantReport",
    "Result",
    "SamplingParams",
    "TextStream",
    "prepare_model",
    "quantize_int8",
]

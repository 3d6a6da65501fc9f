"""minispeed.inference: fused kernels, kernel injection, a paged KV cache, generation, int8 weights.

Reading order: `.kernels_reference` (what each kernel computes) and `.kernels` (the
compiled op and its dispatch); `.kv_cache` (blocks, pool, block tables); `.fused_gpt`
(the fused block and the prefill/decode forward); `.injection` (`init_inference`);
`.generation` (sampling and the generate loop); `.hf_generation` (transformers' `generate` call on the fused model); `.batching` (continuous batching); `.quantize` (int8 weights); `.tensor_parallel`
(the Megatron split of each block over a TP group).

```python
from minispeed.inference import init_inference, generate, SamplingConfig

engine, report = init_inference(gpt, dtype=torch.float32, replace_with_kernel_inject=True)
print(report)
tokens = generate(engine, [[1, 2, 3]], SamplingConfig(max_new_tokens=20, temperature=0.8, top_k=40))
```
"""

from minispeed.inference import decode_plan as decode_plan  # registers the decode plans
from minispeed.inference.batching import ContinuousBatcher, RequestResult
from minispeed.inference.evaluation import perplexity
from minispeed.inference.fused_gpt import FusedGPTBlock, InferenceGPT
from minispeed.inference.generation import SamplingConfig, generate, sample_next
from minispeed.inference.hf_generation import fused_refusal, hf_generate
from minispeed.inference.injection import GPTPolicy, InjectionReport, init_inference, is_recognised
from minispeed.inference.kv_cache import CacheFullError, PagedKVCache, kv_cache_bytes
from minispeed.inference.quantize import Int8Linear, quantize_per_channel, weight_bytes
from minispeed.inference.sparse import SparseSelfAttention, SparsityConfig
from minispeed.inference.tensor_parallel import TPConfig, allreduce_cost, split_by_structure

__all__ = [
    "CacheFullError",
    "ContinuousBatcher",
    "FusedGPTBlock",
    "GPTPolicy",
    "InferenceGPT",
    "InjectionReport",
    "Int8Linear",
    "PagedKVCache",
    "RequestResult",
    "SamplingConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "TPConfig",
    "allreduce_cost",
    "fused_refusal",
    "generate",
    "hf_generate",
    "init_inference",
    "is_recognised",
    "kv_cache_bytes",
    "perplexity",
    "quantize_per_channel",
    "sample_next",
    "split_by_structure",
    "weight_bytes",
]

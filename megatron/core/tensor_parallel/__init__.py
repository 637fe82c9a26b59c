from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  VocabParallelEmbedding, mark_tensor_parallel)
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region,
                                                    scatter_to_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    scatter_to_tensor_model_parallel_region)
from megatron.core.tensor_parallel.random import (checkpoint, get_rng_tracker, init_generator,
                                                  model_parallel_seed)

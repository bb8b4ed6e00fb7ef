"""Host-side planning: conventions, the checkpoint rule set, spec derivation, scheduling and layouts.

Pure Python + numpy: importing it never imports jax or torch.
"""

from jaxckpt.plan.conventions import (NULL_SLOT, PAD_CHECKPOINT_OFFSET, STATE_LAYOUTS, checkpoint_rows,
                                      checkpoints_from_rows, checkpoints_to_rows, map_vllm_slots, pad_checkpoints,
                                      validate_checkpoints, validate_cu_seqlens, validate_slots)
from jaxckpt.plan.layout import ChunkLayout, SplitLaunch, bucket_size, chunk_layout, max_chunks, split_layout
from jaxckpt.plan.rules import (CHECKPOINT_POLICIES, batch_checkpoints, checkpoint_column, checkpoint_grid,
                                checkpoint_position, get_mamba_prefill_checkpoint_position, initial_state_column,
                                is_checkpoint_valid, is_mamba_prefill_checkpoint_valid, model_checkpoint_alignment,
                                prefill_checkpoints, row_checkpoints)

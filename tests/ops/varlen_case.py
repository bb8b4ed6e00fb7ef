"""The packed varlen case the delta rule's implementation tests share: rows of lengths 0, 1, 36, 0, 83 and 10 padding
tokens; checkpoints at 1, len - 1, a chunk boundary (64) and inside chunks, then two padded CSR entries."""

import numpy as np

CU_SEQLENS = np.array([0, 0, 1, 37, 37, 120], np.int32)
NUM_TOKENS = 130
CHECKPOINT_CU = np.array([0, 0, 0, 3, 3, 6], np.int32)
CHECKPOINT_OFFSETS = np.array([1, 16, 35, 1, 64, 82, 0, 0], np.int32)

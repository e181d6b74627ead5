"""AWQ 4-bit checkpoints in the in-process engine: the AutoAWQ GEMM format (``format``), a
linear layer that computes from packed weights (``linear``), making one (``quantize``:
activation-aware scale search), reading one without loading it (``checkpoint``), and
running models whose weights do not fit in memory by staging layers per forward
(``streaming``)."""

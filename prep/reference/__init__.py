"""The reference engine behind ``prep run`` / ``prep compare``: a compact DeepSeek-V3 forward
(``model``), the logical weights it computes with, read from a source or a converted checkpoint
(``weights``), and the runs that drive it (``run``). It is not part of the converter: it reads
checkpoints to show that converted bytes compute what the source computes."""

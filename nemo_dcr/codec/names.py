"""The names of the chunk codings, torch-free: the command line (and with it ``nemo-dcr relay``,
which never decodes) reads them without importing torch."""

OVERWRITE, XOR, ADD, CLASSES = "overwrite", "xor", "add", "classes"
ENCODINGS = (OVERWRITE, XOR, ADD, CLASSES)
AUTO = "auto"  # mixed: per chunk, the smallest of them (see encode_chunk)
PORTABLE = "portable"  # mixed without codings that need the whole base chunk (receivers sharded differently)
CHOICES = (AUTO, PORTABLE, OVERWRITE, XOR, ADD, CLASSES)

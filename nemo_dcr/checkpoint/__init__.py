"""safetensors checkpoints: file I/O, file-level diff/apply, checkpoint publish/pull."""

"""Independent PyTorch reference of the miniature DeepSeek-V4.1-Flash (see README.md)."""

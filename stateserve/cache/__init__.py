"""Cache descriptions (specs), their storage, and the allocators that hand out blocks and slots."""

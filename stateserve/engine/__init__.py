"""The engine loop: requests, the scheduler, the cache manager and detokenisation."""

"""The engine's periodic stats line (every STATESERVE_LOG_STATS_INTERVAL seconds, 0: never): throughput since the
last line, queue and cache use, and with speculative decoding the acceptance since the last line."""
from __future__ import annotations

import logging
import time
from typing import Any

from stateserve import envs

logger = logging.getLogger("stateserve")


class StatsLog:
    def __init__(self) -> None:
        self.last_time = time.monotonic()
        self.last: dict[str, int] = {}

    def maybe_log(self, engine: Any) -> None:
        interval = envs.STATESERVE_LOG_STATS_INTERVAL
        now = time.monotonic()
        if interval <= 0 or now - self.last_time < interval:
            return
        stats, elapsed = engine.stats, now - self.last_time
        delta = {k: v - self.last.get(k, 0) for k, v in stats.items()}
        self.last, self.last_time = dict(stats), now
        line = (f"Engine: prompt throughput {delta['prompt_tokens'] / elapsed:.1f} tokens/s, generation throughput "
                f"{delta['generation_tokens'] / elapsed:.1f} tokens/s, running {len(engine.scheduler.running)}, "
                f"waiting {len(engine.scheduler.waiting)}")
        pool = engine.cache.block_pool
        if pool is not None:
            line += f", KV cache {100 * pool.num_used / pool.num_blocks:.1f}% used"
        logger.info(line)
        if "spec_decode_num_drafts" in stats:
            drafts, tokens = delta["spec_decode_num_drafts"], delta["spec_decode_num_draft_tokens"]
            accepted = delta["spec_decode_num_accepted_tokens"]
            logger.info("Speculative decoding: mean accepted length %.2f, acceptance rate %.1f%% (%d of %d draft "
                        "tokens in %d verify steps)", 1 + accepted / max(drafts, 1), 100 * accepted / max(tokens, 1),
                        accepted, tokens, drafts)

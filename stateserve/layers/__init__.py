"""Building blocks shared by models: attention over the paged cache, recurrent mixers' ops, norms, rotary, sampler."""

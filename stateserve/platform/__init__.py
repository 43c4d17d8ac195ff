"""CPU platform tuning in one place: the C++ kernels' build (cpu_kernels.py) and the table of which kernel serves
what (kernels.py), the malloc settings (host_allocator.py), huge pages (huge_pages.py), resident-memory sampling
(peak_rss.py) and the OpenMP team size under load (cpu_threads.py)."""

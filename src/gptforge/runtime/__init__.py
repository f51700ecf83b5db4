"""Where code runs: device and precision, glibc allocator tuning, process groups, peak FLOP/s for MFU."""

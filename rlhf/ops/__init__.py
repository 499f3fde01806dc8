"""Operations around the training loop: metrics loggers and trackers, watchdog, out-of-memory recovery,
profiling, efficiency figures (MFU, per-phase memory), health alerts, and the hardware facts they use."""

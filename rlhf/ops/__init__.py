"""Operations around the training loop: watchdog, out-of-memory recovery, profiling, efficiency
figures (MFU, per-phase memory), health alerts, and the hardware facts they use."""

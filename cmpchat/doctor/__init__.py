"""`cmpchat doctor`: measure each GPU's paths (memory, DP4A, HFMA2, FFMA, tensor cores, host link, P2P) and
say in plain words which look throttled and which cmpchat uses. Probes in `cmpchat.kernels`."""

"""The forecasts of the systems seqmoe is compared with: training popularity, affinity-style transitions,
moe-infinity-style activation matrices, expertflow-style distance-wise history, and the oracle that
reads the replayed trace's future (`oracle`)."""

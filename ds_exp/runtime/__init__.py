"""One process among a run's ranks: process group, peers, stop signals, compiled ops and their build lock, memory. Layer
6, heavy. May import: the light layers (core, config, data, resume, launch)."""

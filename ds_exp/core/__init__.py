"""What every layer uses: errors meant for people, files written whole as strict JSON, library internals (compat),
announced and bounded waits, user paths that would block. Layer 0. May import: nothing of ds_exp."""

"""Removed: this private module's parts are public in faast.classify (the ImportError below says where each went)."""

raise ImportError(
    "faast._textclf was removed; its parts are public in faast.classify: embed_debian_sections, EmbeddedTask, "
    "ZERO_SHOT_TEMPLATE and cache_dir (faast.classify.debian_task); one_hot and accuracy (faast.classify.readout); "
    "sample_shots(labels, n, g) is faast.classify.sample_episode(labels, ways=None, shots=n, queries=0, "
    "generator=g).support"
)

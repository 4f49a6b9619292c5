"""The version store: every sync as immutable objects in a directory or an S3 bucket, engines that catch up by
themselves, anchors that any HF loader reads, and records a reader verifies before it believes them.

``objects``: the store's objects (POSIX, S3) with create-only writes and a compare-and-swap ``HEAD``;
``manifest``: the records (HEAD, version and anchor manifests), their digests and MACs; ``anchor``: HF checkpoints
of full versions; ``publish``: the trainer's transport into a store; ``catch_up``: an engine walking from what it
holds to a target version; ``tools``: compaction and retention (``python -m sglang.srt.weight_sync.delta store``).
"""

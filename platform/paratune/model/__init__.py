"""The model: built on meta, materialized by shards, adapters, pretrained checkpoints, what a rank holds."""

"""Model construction (torch, no distributed state): partitioning layers into stages, meta-device
building, ``materialize``, pretrained loading, the pipeline hooks, the unpipelined reference and
the summary."""

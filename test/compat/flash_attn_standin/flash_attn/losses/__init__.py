"""Stand-in of ``flash_attn.losses`` (see ``flash_attn.losses.cross_entropy``)."""

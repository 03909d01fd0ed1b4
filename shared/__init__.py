"""What producers and workers share: schemas, codec, Redis key layout, Lua scripts, settings."""

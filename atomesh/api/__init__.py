"""HTTP handlers only: they parse, call the gateway's components and shape responses."""

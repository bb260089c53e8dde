"""Model families: one folder per family, each with its stand-in and (later) its adapter."""

"""The settings file's values and sections, one module per job; `gateway.config` builds
the one validated `Settings` object from them and re-exports what callers use."""

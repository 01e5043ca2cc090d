"""Storage tiers: node-local directory (NVMe), POSIX parallel filesystems, S3 (durable tiers come with
the daemon). ``fileio`` holds the fast, aligned, checksummed file primitives the engine writes with."""

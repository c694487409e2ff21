"""Benchmarks: `kvpager bench throughput | serve | memory | roofline | prefix`."""

"""Operator commands on a cache or a store: ls/verify/gc (admin), publish, demo, and the
throwaway local store (devstore) that the demo, benchmarks and tests run against."""

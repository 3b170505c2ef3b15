"""What the commands do, below their click options: the fetch policy (fetching), operator
commands on a cache or a store: ls/verify/gc (admin), publish, manifest, demo, and the
throwaway local store (devstore) that the demo, benchmarks and tests run against."""

"""Meters: small self-contained measurements that write one CSV row per measurement (docs/results/)."""

"""Command-line entry points: kvpager serve | generate | chat | plan | bench | kv."""

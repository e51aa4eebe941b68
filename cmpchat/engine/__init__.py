"""The one engine loop and what it needs: replies, stop rules, scheduling, the prefix cache, events."""

"""Where data lives: versioned shard stores, their claims and declared tables, atomic files."""

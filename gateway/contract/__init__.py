"""What crosses a process boundary: clean-record headers, failure commands, owner tokens."""

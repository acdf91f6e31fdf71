"""What operators read on a terminal: `tpud run`'s live view and summary, `tpud status`'s table."""

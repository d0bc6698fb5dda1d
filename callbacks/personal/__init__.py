"""Methods that train a whole personal model per client beside (or instead of) the global one."""

"""Where time and tokens go: bubble accounting, metric names, progress, plots and the timeline trace."""

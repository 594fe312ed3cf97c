//! Verification: fixtures, tolerance model and the ssd-oracle command line.

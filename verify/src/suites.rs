//! Suites (WIP).

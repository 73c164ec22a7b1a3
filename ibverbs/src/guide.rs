//! A guide (being written).

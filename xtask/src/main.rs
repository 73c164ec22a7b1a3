fn main() { println!("xtask: not yet implemented"); std::process::exit(1) }

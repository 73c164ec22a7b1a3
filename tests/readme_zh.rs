//! Host test: the Chinese README keeps in step with the English one — the same quick start
//! (`examples/quickstart.rs`, verbatim) and commands, the same selection example (which the
//! `select` module's docs compile) — and each README links to the other.

#[test]
fn chinese_readme_has_the_english_quick_start() {
    let en = include_str!("../README.md");
    let zh = include_str!("../README.zh-CN.md");
    let example = include_str!("../examples/quickstart.rs");
    assert!(
        zh.contains(&format!("```rust\n{example}```")),
        "README.zh-CN.md quick start differs from examples/quickstart.rs"
    );
    for command in [
        "cargo xtask demo",
        "cargo xtask test",
        "cargo build --example quickstart",
        "cargo xtask rxe -- target/debug/examples/quickstart",
        "cargo xtask rxe -- target/debug/examples/doctor",
        "received immediate Some(42)",
    ] {
        assert!(en.contains(command) && zh.contains(command), "{command:?} is not in both READMEs");
    }
    assert!(en.contains("(README.zh-CN.md)") && zh.contains("(README.md)"));
    assert!(en.contains("ibverbs::guide") && zh.contains("ibverbs::guide"));
}

#[test]
fn the_readmes_selection_example_is_the_compiled_one() {
    let select_docs: String = include_str!("../ibverbs/src/select/mod.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect();
    let start = select_docs.find("```no_run\nfn main()").expect("the select module's first example");
    let body_start = start + "```no_run\n".len();
    let end = body_start + select_docs[body_start..].find("```").unwrap();
    let example = &select_docs[body_start..end];
    for (name, readme) in
        [("README.md", include_str!("../README.md")), ("README.zh-CN.md", include_str!("../README.zh-CN.md"))]
    {
        assert!(
            readme.contains(&format!("```rust\n{example}```")),
            "{name} lacks the select example:\n{example}"
        );
    }
}

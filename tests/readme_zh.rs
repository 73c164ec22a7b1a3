//! Host test: the Chinese README keeps in step with the English one — the same quick start
//! (`examples/quickstart.rs`, verbatim) and commands, the same selection example (which the
//! `select` module's docs compile), the same code blocks in the same order, as many sections and
//! the same pages of docs/ — and each README links to the other.

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

/// The fenced code blocks of a Markdown text, fences included, in order.
fn code_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match current.as_mut() {
            None if line.starts_with("```") => current = Some(format!("{line}\n")),
            None => {}
            Some(block) => {
                block.push_str(line);
                block.push('\n');
                if line == "```" {
                    blocks.push(current.take().unwrap());
                }
            }
        }
    }
    assert!(current.is_none(), "an unclosed code block");
    blocks
}

#[test]
fn the_chinese_readme_has_the_english_shape() {
    let en = include_str!("../README.md");
    let zh = include_str!("../README.zh-CN.md");
    // The same code, block for block, in the same order.
    assert!(code_blocks(en).len() >= 6, "the English README's code blocks were not found");
    assert_eq!(code_blocks(en), code_blocks(zh), "the READMEs' code blocks differ");
    // The same number of sections (the titles are translated).
    let sections = |s: &str| s.lines().filter(|l| l.starts_with("## ")).count();
    assert_eq!(sections(en), sections(zh), "the READMEs have different numbers of sections");
    // Every page of docs/ the English README links to, the Chinese one links to as well.
    for link in en.split("](docs/").skip(1) {
        let target = &link[..link.find(')').unwrap()];
        assert!(zh.contains(&format!("](docs/{target})")), "README.zh-CN.md lacks the link to docs/{target}");
    }
}
